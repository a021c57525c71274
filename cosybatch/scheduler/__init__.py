"""The GPU timeline of the fast pipeline: what runs when (``policy``), what it costs
(``costs``) and where the time went (``accounting``)."""
