"""The IPython side: thin magics (argument parsing and display only) and the live output sink."""
