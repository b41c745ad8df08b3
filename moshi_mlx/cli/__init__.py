"""The command line: thin entry points over the library, their shared flags and one error path."""
