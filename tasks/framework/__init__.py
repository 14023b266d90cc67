"""The framework every step runs on: errors, hashing, the store, lineage, the step declaration,
the recipe graph and its executor. Steps live beside this folder and import from it; nothing
here imports a step."""
