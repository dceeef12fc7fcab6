"""`lorafleet`'s argparse parsers, one module per command group; each names its run in cli/commands.py."""
