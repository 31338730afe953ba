"""autoclip: against smartclip's AutoClip core, and its geometric quantile."""
