"""`kda-patches` dispatch: delegated subcommands own their options; `run` hands over to the launcher."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kda_patches import cli


def test_delegated_subcommands_get_their_own_arguments(monkeypatch):
    received = {}

    def fake_delegate(module, argv):
        received[module] = argv
        return 3

    monkeypatch.setattr(cli, "command_delegate", fake_delegate)
    assert cli.main(["bench", "state-copy", "--help"]) == 3
    assert cli.main(["regress", "--workload", "x", "--json"]) == 3
    assert received == {"kda_patches.bench": ["state-copy", "--help"],
                        "kda_patches.regress.cli": ["--workload", "x", "--json"]}


@pytest.mark.parametrize("command", ["bench", "regress"])
def test_delegated_help_reaches_the_subcommand_parser(command):
    result = subprocess.run([sys.executable, "-m", "kda_patches", command, "--help"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"usage: kda-patches {command}")


def test_run_without_command_explains_usage(capsys):
    assert cli.main(["run"]) == 2
    assert "after '--'" in capsys.readouterr().err


def test_kda_run_execs_the_command_in_place():
    """The command runs in the process ``kda-run`` was started as (exec, no wrapper child in between)."""
    script = os.path.join(os.path.dirname(sys.executable), "kda-run")
    report = "import os; print(os.getpid(), os.getppid())"
    process = subprocess.Popen([script, sys.executable, "-c", report], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 0, stderr
    # Independent of the launcher: Popen's own child pid, and this test process as that child's parent.
    assert [int(field) for field in stdout.split()] == [process.pid, os.getpid()]


KIMI_LEDGER = {
    "pid": 4242, "role": "worker", "argv": ["x"], "started_at": 0.0, "written_at": 0.0, "final": True,
    "switches": {},
    "patches": {"kimi_prefill": {"state": "applied", "reason": "", "targets": {}},
                "gdn_state_copy": {"state": "applied", "reason": "", "targets": {}}},
    "counters": {"kimi_prefill": {"calls_seen": 7, "calls_routed": 4, "calls_bypassed": 1, "calls_refused": 2},
                 "gdn_state_copy": {"calls_seen": 3, "calls_routed": 3, "calls_failed": 1}},
    "facts": {"kimi_prefill": {"model.layers.3.self_attn": {"plan_kind": "fused"},
                               "model.layers.1.self_attn": {"plan_kind": "fused"},
                               "model.layers.2.self_attn": {"plan_kind": "fallback"},
                               "note": "not a layer"},
              "gdn_state_copy": {"model.layers.4.linear_attn": {"plan_kind": "fused", "decision": "overlay-plan"},
                                 "model.layers.5.linear_attn": {"plan_kind": "fused", "decision": "fork-native"}}},
}
# Written by hand from the ledger above (the design's status format), not produced by the formatter.
STATUS_LINES = [
    "  kimi_prefill: prefill calls seen 7, routed 4, bypassed 1, refused 2; "
    "plans fallback=1 (model.layers.2.self_attn), fused=2 (model.layers.1.self_attn\u2026)",
    "  gdn_state_copy: prefill calls seen 3, routed 3, bypassed 0, failed 1; "
    "plans fork-native:fused=1 (model.layers.5.linear_attn), fused=1 (model.layers.4.linear_attn)",
]


def test_cli_status_prints_the_kimi_summary_line(tmp_path, capsys):
    """``status --from DIR`` on a fixed ledger file prints the literal state-copy summary lines."""
    (tmp_path / "ledger-4242.json").write_text(json.dumps(KIMI_LEDGER))
    assert cli.main(["status", "--from", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line for line in lines if line.startswith(("  kimi_prefill:", "  gdn_state_copy:"))] == STATUS_LINES


def test_status_shows_a_choice_left_at_its_default():
    """A switch at ``auto`` (PDL's default) is listed as a choice in force, not hidden; a changed one as set."""
    from kda_patches.flags import Flags

    default = cli.format_switches(Flags().as_dict())
    assert default[0] == "switches: {}"
    assert '"KDA_PATCHES_PDL": "auto"' in default[1]
    assert '"KDA_PATCHES_GDN_OPS": "measured"' in default[1]
    changed = cli.format_switches(Flags(pdl="off", strict=True).as_dict())
    assert json.loads(changed[0].removeprefix("switches: ")) == {"KDA_PATCHES_PDL": "off", "KDA_PATCHES_STRICT": True}
    assert "KDA_PATCHES_PDL" not in changed[1]


def test_status_lists_a_switch_this_version_does_not_know_as_set():
    assert cli.format_switches({"KDA_PATCHES_FUTURE": "auto"})[0] == 'switches: {"KDA_PATCHES_FUTURE": "auto"}'
