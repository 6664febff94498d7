import sys

from . import train_main

sys.exit(train_main())
