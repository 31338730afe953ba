"""zclip against the zclip package and its FIXes."""
