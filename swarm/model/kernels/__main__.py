"""`python -m swarm.model.kernels`: build the kernels' libraries (see build.py)."""

from swarm.model.kernels.build import main

main()
