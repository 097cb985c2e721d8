"""The tuning loop: knowledge base, composing candidates, acceptance limits, trials and ``auto``.

Cores only: nothing here imports typer or rich. The CLI modules (rltune/cli/propose.py, trial.py,
auto.py, report.py) parse arguments, call these functions and print.
"""
