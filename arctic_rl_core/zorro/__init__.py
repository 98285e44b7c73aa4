"""ZoRRo: compute shared prefixes once, in training (train/) and in decode (attention/)."""
