"""The check loop: observe (scan) -> decide -> apply (through bind/) -> publish."""
