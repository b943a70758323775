"""Prints the first ```bash block under a README heading, so CI runs the very command a reader
copies: `python3 .ci/readme_block.py Install`."""

import re
import sys
from pathlib import Path

heading = sys.argv[1]
text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
section = re.split(r"^## ", text, flags=re.M)
body = next(s for s in section if s.startswith(heading + "\n"))
print(re.search(r"^```bash\n(.*?)^```", body, flags=re.M | re.S).group(1).strip())
