"""`python -m qual` runs the CLI."""

from qual.cli.entry import main

if __name__ == "__main__":
    main()
