module stinterop

go 1.19
