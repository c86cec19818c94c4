import sys

from fsdata.cli import main

sys.exit(main())
