"""The model's text split, as it streams, into content and calls: the splitter finds them, the reader reads them."""
