"""Developer tools: a shaped TCP relay and a virtual-time link simulator.

Not installed with the package (pyproject lists only swarm's packages); tests and scripts use
them from a checkout, run from the repository's root: `python -m devtools.relay --help`.
"""
