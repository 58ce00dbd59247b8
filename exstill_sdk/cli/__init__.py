"""Command-line tools: exstill-emu, exstill-bench (more follow: pack, flash, info)."""
