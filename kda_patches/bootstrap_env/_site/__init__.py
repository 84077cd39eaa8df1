"""Holds the activation shim ``sitecustomize.py`` that the launcher puts first on ``PYTHONPATH``.

This directory is a package only so that it ships with the wheel; nothing imports it as one.
"""
