"""Switch parsing: defaults, validation, unknown names, per-patch selection."""

from __future__ import annotations

import logging

import pytest

from kda_patches.flags import SWITCHES, Flags, parse_flags

KNOWN = ("gdn_host_flags", "kimi_prefill")


def test_defaults_enable_everything():
    flags = parse_flags({}, KNOWN)
    assert flags.enabled and not flags.strict and not flags.force_triton
    assert all(flags.patch_enabled(name) for name in KNOWN)
    assert set(flags.as_dict()) <= set(SWITCHES)


def test_master_switch_off_disables_every_patch():
    flags = parse_flags({"KDA_PATCHES": "0"}, KNOWN)
    assert not any(flags.patch_enabled(name) for name in KNOWN)


def test_disable_and_only_select_patches():
    assert not parse_flags({"KDA_PATCHES_DISABLE": "kimi_prefill"}, KNOWN).patch_enabled("kimi_prefill")
    only = parse_flags({"KDA_PATCHES_ONLY": " gdn_host_flags "}, KNOWN)
    assert only.patch_enabled("gdn_host_flags") and not only.patch_enabled("kimi_prefill")


def test_unknown_patch_names_warn_with_the_valid_list(caplog):
    with caplog.at_level(logging.WARNING, logger="kda_patches"):
        flags = parse_flags({"KDA_PATCHES_DISABLE": "gdn_hostflags"}, KNOWN)
    assert any("gdn_hostflags" in w and "gdn_host_flags, kimi_prefill" in w for w in flags.warnings)
    assert any("gdn_hostflags" in record.getMessage() for record in caplog.records)


def test_unknown_switch_is_warned_about():
    flags = parse_flags({"KDA_PATCHES_STRICTT": "1"}, KNOWN)
    assert any("KDA_PATCHES_STRICTT" in w and "KDA_PATCHES_STRICT" in w for w in flags.warnings)


@pytest.mark.parametrize(("variable", "value"), [("KDA_PATCHES_STRICT", "maybe"), ("KDA_PATCHES", "2"),
                                                 ("KDA_PATCHES_LOG", "LOUD"),
                                                 ("KDA_PATCHES_KV_STATE_MODE", "elsewhere")])
def test_malformed_values_raise_naming_the_variable(variable, value):
    with pytest.raises(ValueError, match=variable):
        parse_flags({variable: value}, KNOWN)


def test_paths_split_on_pathsep_and_flags_are_immutable():
    flags = parse_flags({"KDA_PATCHES_PRELOAD": "/a/lib1.so:/b/lib2.so", "KDA_PATCHES_FORCE_TRITON": "yes"}, KNOWN)
    assert flags.preload == ("/a/lib1.so", "/b/lib2.so") and flags.force_triton
    with pytest.raises(AttributeError, match="immutable"):
        flags.strict = True
    assert flags == parse_flags({"KDA_PATCHES_PRELOAD": "/a/lib1.so:/b/lib2.so",
                                 "KDA_PATCHES_FORCE_TRITON": "1"}, KNOWN)
    assert isinstance(flags, Flags)


def test_the_release_cache_variable_is_a_known_switch():
    # read by kda_patches.releases.fetch, not at activation: it must not be warned about as unknown
    assert not parse_flags({"KDA_PATCHES_RELEASE_CACHE": "/tmp/cache"}, known_patches=()).warnings


def test_gdn_ops_switch_defaults_to_measured_and_accepts_upstream_and_overlay():
    assert parse_flags({}, KNOWN).gdn_ops == "measured"
    assert parse_flags({"KDA_PATCHES_GDN_OPS": "upstream"}, KNOWN).gdn_ops == "upstream"
    assert parse_flags({"KDA_PATCHES_GDN_OPS": " Overlay "}, KNOWN).gdn_ops == "overlay"
    assert parse_flags({"KDA_PATCHES_GDN_OPS": "overlay"}, KNOWN).as_dict()["KDA_PATCHES_GDN_OPS"] == "overlay"
    with pytest.raises(ValueError, match="KDA_PATCHES_GDN_OPS"):
        parse_flags({"KDA_PATCHES_GDN_OPS": "fork"}, KNOWN)


def test_state_io_switch_defaults_to_measured_and_accepts_copy_indexed_and_auto():
    assert parse_flags({}, KNOWN).state_io == "measured"
    assert parse_flags({}, KNOWN).as_dict()["KDA_PATCHES_STATE_IO"] == "measured"
    for choice in ("copy", "indexed", "auto"):
        assert parse_flags({"KDA_PATCHES_STATE_IO": f" {choice.upper()} "}, KNOWN).state_io == choice
    with pytest.raises(ValueError, match="KDA_PATCHES_STATE_IO='inplace' is not a choice; use one of measured"):
        parse_flags({"KDA_PATCHES_STATE_IO": "inplace"}, KNOWN)


def test_pdl_switch_is_auto_by_default_and_otherwise_parsed_as_a_boolean():
    assert parse_flags({}, KNOWN).pdl == "auto" and parse_flags({"KDA_PATCHES_PDL": " Auto "}, KNOWN).pdl == "auto"
    assert parse_flags({"KDA_PATCHES_PDL": "1"}, KNOWN).as_dict()["KDA_PATCHES_PDL"] == "on"
    assert parse_flags({"KDA_PATCHES_PDL": "off"}, KNOWN).pdl == "off"
    with pytest.raises(ValueError, match="KDA_PATCHES_PDL='fast' is not a choice; use KDA_PATCHES_PDL=auto"):
        parse_flags({"KDA_PATCHES_PDL": "fast"}, KNOWN)


@pytest.mark.parametrize(("raw", "expected"), [(None, "auto"), ("auto", "auto"), ("yes", True), ("0", False)])
def test_the_pdl_choice_becomes_the_plans_argument(raw, expected):
    environ = {} if raw is None else {"KDA_PATCHES_PDL": raw}
    assert parse_flags(environ, KNOWN).pdl_request() == expected


def test_a_hand_built_pdl_choice_outside_the_three_is_refused_by_name():
    with pytest.raises(ValueError, match="auto, on, off"):
        Flags(pdl="1").pdl_request()
