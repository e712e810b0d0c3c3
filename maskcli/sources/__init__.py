"""Every way a mask comes in, one module each with its `load`; registry.py picks the one for what the user gave,
and every command asks it (`registry.mask`) for the one Mask the rest of maskcli checks and shows."""
