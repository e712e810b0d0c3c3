"""Every way a mask comes in, one module each with its `load`; registry.py picks the one for what the user gave,
and every command asks it (`registry.load`) for the one Mask the rest of maskcli checks and shows. The masks metadata
implies (engine: a serving batch's requests, packed: a packed batch's documents, ranks: a layout's ranks) come from
sources too, which read the metadata with pack/ and serve/ and make Masks of it: serve, pack and shard ask the
registry for them (`registry.read`, `registry.sources()[name].load`)."""
