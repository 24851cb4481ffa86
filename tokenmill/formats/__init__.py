"""On-disk formats, one module per format (writer, reader and constants side by side)."""
