"""``python -m shardops_models.search``: rank every strategy × mesh (see the package docstring)."""

from shardops_models.search._cli import main

if __name__ == "__main__":
    main()
