"""Passkey demo (see `locks_hf.demo`): python scripts/demo.py --help"""

from locks_hf.demo import main

raise SystemExit(main())
