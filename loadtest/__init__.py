"""loadtest package."""
