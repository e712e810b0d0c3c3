"""A serving engine's batch metadata as masks: loaders per engine layout, pages, and the rules that check them."""
