"""What the server and the devices share, imported downward by both: the run settings as typed records, the
message layout on the wire, and Flower's transport as edgefl tunes it."""
