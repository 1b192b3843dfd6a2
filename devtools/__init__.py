"""Developer tools: a shaped TCP link proxy, a virtual-time link simulator, node launchers.

Not installed with the package (pyproject lists only swarm's packages); tests and scripts use
them from a checkout, run from the repository's root: `python -m devtools.link_proxy --help`.
"""
