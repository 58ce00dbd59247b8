"""Command-line tools: exstill (demo), exstill-emu, exstill-pack, exstill-flash, exstill-info,
exstill-bench; support.py holds what they share (exit codes, one-line errors, Ctrl-C)."""
