"""
The lab: what measures and reports rather than implements (benchmarks, evaluation, the paper's
training grid, its claims, report and figures, the Ouro export). Each runs from the project root as a
module, `python -m lab.reproduce --help`; nothing outside lab/ imports it.
"""
