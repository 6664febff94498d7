import sys

from . import eval_main

sys.exit(eval_main())
