"""Code that more than one test module uses, one concept per module, so that no test module imports another (a test
module imported by name is imported a second time, under another name, with its own copies of its fixtures)."""
