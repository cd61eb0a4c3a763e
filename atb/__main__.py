import sys

from atb.cli import main

sys.exit(main())
