import sys

from tiershard.cli import main

sys.exit(main())
