module mutantschema

go 1.26.0
