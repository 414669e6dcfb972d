import sys

from maxjax.cli.main import main

sys.exit(main())
