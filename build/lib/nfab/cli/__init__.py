"""nfab's command line: one module per subcommand, each only parsing and calling the library."""
