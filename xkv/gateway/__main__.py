"""``python -m xkv.gateway`` = ``xkv-gateway``."""

import sys

from xkv.gateway.server import main

sys.exit(main())
