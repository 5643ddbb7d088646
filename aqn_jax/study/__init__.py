"""The multi-seed study: statistics over seeds (`stats`) and the study report (`report`).

The `compare` job trains every arm for K seeds and writes `results.json`; `report.write_report`
turns it into `report.md` (tables, Welch tests with Holm-adjusted p-values) and plots.
"""
