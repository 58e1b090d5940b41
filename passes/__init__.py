"""toptpu."""
