"""``python -m shardops_models.search``: rank every strategy × mesh (see the package docstring)."""

from shardops_models.search._search import main

if __name__ == "__main__":
    main()
