# The repository root is on sys.path for the tests, so `samples` imports as a package.
