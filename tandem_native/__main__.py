"""`python -m tandem_native`: build the native library now (`tandem_native.loader.main`)."""

import sys

from tandem_native.loader import main

sys.exit(main())
