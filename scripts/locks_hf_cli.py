#!/usr/bin/env python
"""Evaluation CLI (thin wrapper of `locks_hf.eval.cli`): sweep, merge, report, fidelity, ruler-generate,
infinitebench-score. Same as the `locks-hf-eval` console script. Run with --help."""

from locks_hf.eval.cli import main

if __name__ == "__main__":
    main()
