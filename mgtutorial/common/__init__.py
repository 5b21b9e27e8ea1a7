"""What every chapter shares: configuration checks (``config``), data (``data``), models
(``models``), checkpoints (``checkpoint``) and comparisons with a single-process reference
(``compare``). Imports no chapter's subpackage."""
