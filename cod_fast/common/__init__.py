"""The ground under every layer: bounded reads, writes that follow no link, checked values read
back from files, and random number generator state. Imports nothing of the project."""
