module github.com/hermesfs/hermesfs

go 1.26.8
