package crypt

import "filippo.io/age"

// NewScryptRecipientForTest wraps a passphrase recipient, as age -p uses.
func NewScryptRecipientForTest(pw string) (*Recipients, error) {
	r, err := age.NewScryptRecipient(pw)
	if err != nil {
		return nil, err
	}
	r.SetWorkFactor(10)
	return &Recipients{list: []age.Recipient{r}}, nil
}
