"""Ray actors and the driver: thin shells that each own one `opd` object and move data between them."""
