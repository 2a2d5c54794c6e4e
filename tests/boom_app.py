"""An app module whose own code fails at import (as a missing setting or file would)."""

raise RuntimeError("import boom: RUNPOOL_TEST_SETTING is not set")
