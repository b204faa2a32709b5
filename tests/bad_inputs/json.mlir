{"module": "m"}
