import sys

from sim.repro import main

sys.exit(main())
