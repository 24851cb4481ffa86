"""Development helpers kept out of the installed package: the demo corpus and the bundled
test tokenizers (``make tokenizers``). Import from the repository root."""
