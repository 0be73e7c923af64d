"""`python -m diffrl ...` is the `diffrl` command."""

import sys

from diffrl.flows.cli import main

sys.exit(main())
