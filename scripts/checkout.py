"""Scripts run from a checkout: `import checkout` puts its root on the path, for devtools/
(developer tools, not installed with the package)."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import swarm  # noqa: E402,F401 (before torch, as in a node: OpenMP's wait policy, see swarm/__init__)
